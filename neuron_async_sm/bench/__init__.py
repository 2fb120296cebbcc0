"""`neuron-async-sm bench`: async against sync, against the overlap limit and against transformers."""
