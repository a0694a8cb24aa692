"""Fast kernels, each beside the pure-torch reference it is tested against."""
