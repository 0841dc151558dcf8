"""Pipeline schedules as plain data, and the tools that read them: generators, registry,
NCCL-rules validator, simulator, timeline drawing and `merak simulate`. Nothing here touches a
process group; the runtime (`merak.runtime`) executes these programs."""
