"""`dropless.parallelize`'s refusals, in one child process: first without a process group,
then in a 1-process gloo group (what can be refused there: a model Transformers' tensor
parallelism laid out among them); last, the call that works on
one process equals the model it was given (logits; with activation checkpointing, the
loss and every gradient). Prints OK."""

import copy

import torch
import torch.distributed as dist

import dropless
from harness import tiny_moe_config


def _raises(fn, *words):
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        msg = str(e)
        assert all(w in msg for w in words), (words, msg)
        return
    raise AssertionError(f"no error; expected one naming {words}")


def _checkpointed_equals_plain(stock, ids):
    """parallelize(activation_checkpointing=True) on one process: the loss and every
    gradient of the model it was given."""
    ref = dropless.patch_model(copy.deepcopy(stock))
    ref(input_ids=ids, labels=ids).loss.backward()
    model = dropless.patch_model(copy.deepcopy(stock))
    dropless.parallelize(model, activation_checkpointing=True)
    assert model.is_gradient_checkpointing
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=0)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, want[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def _bf16_compute(stock, ids, want):
    """mixed_precision=torch.bfloat16: the weights a forward sees are bf16 (the logits
    come out bf16, within bf16 rounding of fp32's), the stored ones stay fp32."""
    model = dropless.patch_model(copy.deepcopy(stock))
    dropless.parallelize(model, mixed_precision=torch.bfloat16)
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16, logits.dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
    err = (logits.float() - want).norm() / want.norm()
    assert err < 2e-2, float(err)


def _peft_experts_refused(stock):
    """PEFT's target_parameters LoRA on the experts cannot be split by expert."""
    from peft import LoraConfig, get_peft_model

    names = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = dropless.patch_model(copy.deepcopy(stock))
    model = get_peft_model(model, LoraConfig(r=2, target_parameters=names, target_modules=[]))
    _raises(lambda: dropless.parallelize(model), "target_parameters", "attach_expert_lora")


def main():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe"))
    _raises(lambda: dropless.parallelize(stock, ep=1), "torch.distributed", "torchrun")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _raises(lambda: dropless.parallelize(stock), "dropless.patch()", "patch_model")
    model = dropless.patch_model(copy.deepcopy(stock))
    _raises(lambda: dropless.parallelize(model, ep=2), "ep=2", "pick ep from [1]")
    _raises(lambda: dropless.parallelize(model, ep=0), "ep=0")
    _raises(lambda: dropless.parallelize(model, cp=2), "cp = 1 x 2 = 2", "pick cp from [1]")
    _peft_experts_refused(stock)
    first = next(model.parameters())
    first.ds_id = 0  # what DeepSpeed ZeRO-3 leaves on every parameter it partitions
    _raises(lambda: dropless.parallelize(model), "ZeRO-3", "deepspeed")
    del first.ds_id
    for mark, value in (("_tp_size", 2), ("_device_mesh", object())):
        setattr(model, mark, value)  # what from_pretrained(tp_plan=...) leaves on the model
        _raises(lambda: dropless.parallelize(model), "own tensor or expert parallelism", "tp_plan")
        delattr(model, mark)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    want = model(input_ids=ids).logits
    assert dropless.parallelize(model, ep=1) is model
    from transformers.distributed.fsdp import is_fsdp_managed_module

    # Transformers' marks: Trainer leaves the model to parallelize, generate syncs the ranks
    assert model.is_distributed_loading_by_transformers and is_fsdp_managed_module(model)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    _raises(lambda: dropless.parallelize(model), "already distributed", "once")
    _checkpointed_equals_plain(stock, ids)
    _bf16_compute(stock, ids, want)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
