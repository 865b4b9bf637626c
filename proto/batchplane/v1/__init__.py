"""The batchplane v1 wire contract: code generated from the .proto files beside it.

Regenerate with `make proto`; never edit the *_pb2 files by hand.
"""
