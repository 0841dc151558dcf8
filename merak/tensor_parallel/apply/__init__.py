"""A model's plan chosen (given, recorded, the family's, inferred from its blocks), its modules
converted by it, and `merak tp-plan`."""
