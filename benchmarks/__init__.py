"""The benchmarks: scripts that measure what the tests cannot (speed, precision, search efficiency).

Each runs from the repository's root as ``python -m benchmarks.<name>``; ``benchmarks/README.md`` says
what each answers and how long it takes, and ``benchmarks/RESULTS.md`` holds their latest runs.
"""

QUICK_HELP = "a small run, in seconds, that shows the script works (the tests run it); no figures to report"
