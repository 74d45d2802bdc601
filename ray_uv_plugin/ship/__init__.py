"""Moving a ready venv between nodes: the archive stream, the transfer through Ray's object
store, and the install of a received venv. Imports `store` and `agent`, nothing above them."""
