"""`merak coverage`. The prefixes of the rows the sweep's worker writes and its summary reads
(here, so that the command line starts without importing the worker's model stack)."""

NO_PLAN = "no plan"  # a row's prefix: not even plan inference places a layer of the family
HF_CANNOT_LOAD = "HF's from_pretrained fails"  # a load row's prefix: not Merak's result
