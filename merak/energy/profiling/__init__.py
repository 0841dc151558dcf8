"""GPU clock control and profiling: NVML or a simulated GPU, locked clocks reset however the
process ends (guard, watchdog), each instruction's time and energy per clock, the profile CSV."""
