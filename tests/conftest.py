import warnings

# PyTensor warns about BLAS on pip installs; the numba backend does not need it.
warnings.filterwarnings("ignore", message="PyTensor could not link to a BLAS")
