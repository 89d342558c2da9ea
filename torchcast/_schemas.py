"""The schemas of the torchcast ops, as csrc/ops.cpp defines them, for the
build without the compiled extension (_python_ops.py), where nothing else
defines them. tests/test_packaging.py checks that the two agree."""

_ADAM_ARGS = (
    "(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
    "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] compensations, Tensor(g!)[] state_steps, *, "
    "{lr}, float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, "
    "bool decoupled_weight_decay, str compensation, Tensor? grad_scale=None, "
    "Tensor? found_inf=None, int seed=0, Tensor(h!)[]? update_stats=None, "
    "Tensor(i!)[]? moment_scales=None) -> ()")

SCHEMAS = {
    "cast_with_stats": "cast_with_stats(Tensor x, ScalarType dtype, Tensor? scale=None, *, "
                       "bool? saturate=None) -> (Tensor y, Tensor stats)",
    "cast_with_stats.out": "cast_with_stats.out(Tensor x, ScalarType dtype, Tensor? scale=None, *, "
                           "bool? saturate=None, Tensor(a!) out) "
                           "-> Tensor stats",
    "adam_step_": "adam_step_" + _ADAM_ARGS.format(lr="float lr"),
    "adam_step_.tensor_lr": "adam_step_.tensor_lr" + _ADAM_ARGS.format(lr="Tensor lr"),
    "kahan_sum": "kahan_sum(Tensor x, int[1]? dim=None, bool keepdim=False, *, "
                 "ScalarType? dtype=None) -> Tensor",
    "kahan_mean": "kahan_mean(Tensor x, int[1]? dim=None, bool keepdim=False, *, "
                  "ScalarType? dtype=None) -> Tensor",
    "tensor_health": "tensor_health(Tensor x) -> (Tensor counts, Tensor hist, Tensor extrema)",
    "block_cast": "block_cast(Tensor x, str format, int block_size, str scale_mode, "
                  "Tensor? tensor_scale=None) -> (Tensor data, Tensor scales, Tensor stats, "
                  "Tensor scale_hist, Tensor block_counts)",
}
