"""What every part of the engine uses: the exception types, size strings, an item's dtype
names and CRC-32, and process identities (pid + start time) with their liveness.

Imports nothing of the engine above it and never imports torch.
"""
