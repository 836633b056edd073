"""The benchmarks: scripts that measure what the tests cannot (speed, precision, search efficiency).

Each runs from the repository's root as ``python -m benchmarks.<name>``; ``benchmarks/README.md`` says
what each answers and how long it takes, and ``benchmarks/RESULTS.md`` holds their latest runs.
"""
