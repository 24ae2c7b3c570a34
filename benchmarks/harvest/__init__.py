"""After training: the harvest's throughput against its bound, and the browser's page load
over a whole model's harvest.
"""
