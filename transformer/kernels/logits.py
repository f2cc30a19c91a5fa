"""The output projection of a bfloat16 or float16 model, its logits never rounded."""

import jax
import jax.numpy as jnp


def _logits(states, table):
  return jnp.einsum('...d,vd->...v', states, table.astype(states.dtype),
                    preferred_element_type=jnp.float32)


def _logits_gradients(residuals, grads):
  """The products in the states' dtype, summed in float32, as the forward's: autodiff would
  multiply the float32 logit gradients with the low-precision operands in float32."""
  states, table = residuals
  dtype = states.dtype
  grads = grads.astype(dtype)
  return (jnp.einsum('...v,vd->...d', grads, table.astype(dtype),
                     preferred_element_type=jnp.float32).astype(dtype),
          jnp.einsum('...v,...d->vd', grads, states,
                     preferred_element_type=jnp.float32).astype(table.dtype))


low_precision_logits = jax.custom_vjp(_logits)
low_precision_logits.defvjp(lambda states, table: (_logits(states, table), (states, table)),
                            _logits_gradients)
low_precision_logits.__doc__ = """Float32 logits of bfloat16 or float16 `states` [..., d_model]
against a table [vocab, d_model]: the operands in the states' dtype run at the matrix units' full
rate, the products sum in float32, each way."""
