"""The study: the loop that asks, runs and tells (loop.py), the trial runner, the defaults' trial, the
finalists' reruns, slots, recovery and the rest of the loop's parts."""
