"""The strategy search's half that runs dry runs on the job's ranks (`merak plan --online`,
`auto_parallel`): each candidate's real engine, built by `merak.engine`, timed for a few steps."""
