"""The scheduling plane: profiles of small pure plugins (filters, scorers, a picker, hooks) that pick a
target for a request (framework.py; the ``--policy`` presets in presets.py).

Every decision is made from (the request's tokens or text, the index, the fleet's in-flight loads) and
the plugins' own state, nothing else, so decisions are unit-tested without I/O. The proxy owns the I/O
around them.
"""
