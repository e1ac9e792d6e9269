"""Session affinity: remember which engine served a conversation and send its next turn there.

- ``keys``: the explicit session key of a request (never a payload-derived one), hashed.
- ``store``: where a key's last engine is remembered (an in-process LRU with a TTL).
- ``classify``: the functional core, new / stale / returning and the promoted candidate order.
- ``affinity``: the shell the proxy calls (lookup with a hard deadline, hints, writes, metrics).

Design and rules: docs/sessions.md.
"""
