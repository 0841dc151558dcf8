"""The engine: `merak.parallelize` (the fixed build order from a model to this rank's stage,
`parallelize.py`) and the one assembly around it (`build_engine`, `assemble.py`: the stage, its
`PipelineInterpreter`, optimizer, gradient clipping, fp16 loss scaling, timers and
`torch_compile`) from one frozen `EngineOptions`. Which option combinations are refused is
`merak.rules`."""
