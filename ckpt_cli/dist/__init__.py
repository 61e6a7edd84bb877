"""torchrun: the launch environment (`launch`), running one command across ranks (`command`) and rank placement of tensor chunks (`placement`)."""
