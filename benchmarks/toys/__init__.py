"""The toy models: recovery of their ground truth over seeds, the train step's throughput
(against the torch reference's), where it spends its time, and sweeps of seeds.
"""
