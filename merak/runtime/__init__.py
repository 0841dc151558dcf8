"""The pipeline runtime: what runs a rank's stage once it is built. One runner per local stage,
the interpreter that walks the rank's program (training, evaluation, the activation
measurement), point-to-point transfers under NCCL's rules with the shapes found before a step,
micro-batch handling, the per-step tail (tied and data-parallel gradient reduction, optimizer
step), hooks, device timers and the memory probe. The split into stages is
`merak.partition`'s."""
