"""On a TPU: the accelerator check (`accel_check.sh`), the train step's time and fit on one
chip, and what XLA:TPU's compiler says of a program compiled on a CPU without a chip (memory,
cost model, compile time).
"""
