"""Pure tensor kernels: gradient, feature, histogram, non-finite statistics; workspaces."""
