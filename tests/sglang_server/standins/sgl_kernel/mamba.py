"""``sgl_kernel.mamba`` names that SGLang 0.5.23 imports on CPU for linear-attention models
(GDN / KDA backends). Part of hetrl's pure-torch stand-in for sgl-kernel (see
``sgl_kernel/__init__.py``): not implemented, they raise NotImplementedError when called."""

from sgl_kernel import _not_implemented

causal_conv1d_fn_cpu = _not_implemented("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_implemented("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _not_implemented("mamba.chunk_gated_delta_rule_cpu")
