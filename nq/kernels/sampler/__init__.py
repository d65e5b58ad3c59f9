"""Device sampler (design notes follow in a later commit)."""
from nq.kernels.sampler.launcher import Sampler, make_sampler
from nq.kernels.sampler.params import PARAMS_LEN, pack_params, unpack_params, from_sampling_params
from nq.kernels.sampler.reference import sample_reference, filtered_distribution

__all__ = ["Sampler", "make_sampler", "PARAMS_LEN", "pack_params", "unpack_params",
           "from_sampling_params", "sample_reference", "filtered_distribution"]
