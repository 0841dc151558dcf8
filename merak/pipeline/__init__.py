"""Pipeline parallelism: schedules as data, the split, the interpreter, the simulator."""
