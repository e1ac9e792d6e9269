"""The routing plane: pure policies that pick a target for a request.

Every policy decides from (the request's tokens or text, the index, the fleet's in-flight loads, fleet/)
and nothing else, so decisions are unit-tested without I/O. The proxy owns the I/O around them.
"""
