"""The one engine assembly: from a model, an example batch, the context and one frozen
`EngineOptions`, this rank's stage and its `PipelineInterpreter` (`build_engine`), plus the
rules that say which option combinations are refused (`rules`)."""
