"""Peer bootstrap: a booting replica grafts a warm sibling's index beneath its live event stream.

``wire`` is the snapshot envelope (untrusted bytes <-> ``WireSnapshot``); ``vetting`` is the only way
a ``WireSnapshot`` becomes a graftable ``VettedSnapshot``.
"""
