"""The bottom layer every other uses: errors that stop a run before it trains, the processes of a
run (distributed.py: process groups, gathers; launch.py: how they were launched), stop signals,
the user's code (found by name, timed out, its exits caught), and the memory allocator."""
