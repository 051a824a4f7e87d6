"""What travels between client, connection process and job process: the dill codec (codec), RPyC's
socket stream without its costs (stream), large buffers raw beside it (bulk), and arguments passed
by reference copied within bounds (netrefs)."""
