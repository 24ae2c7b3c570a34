"""pdctl's benchmarks, by the question each answers (a folder a question). Each prints what it
measured, with the commit, machine and time it ran on (`_harness.machine_line`), as a table
and a ratio measured in one run. Run one as a module from the checkout's root:
`python -m benchmarks.QUESTION.NAME --help`. Their figures are logged in docs/performance.md
and docs/results.md (the current ones in docs/figures.md).
"""
