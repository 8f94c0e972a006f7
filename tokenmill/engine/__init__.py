"""The engine-core process: `core` (scheduler + executor), `core_proc` (its process loop), `messages` (the wire types).

Importing this package imports nothing, so `tokenmill.engine.messages` stays a leaf.
"""
