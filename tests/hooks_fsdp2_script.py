"""FSDP2 (fully_shard) on CPU/gloo with ckptsup, for tests/test_resume_fsdp2.py.

    torchrun --nproc-per-node 2 tests/hooks_fsdp2_script.py CKPT_DIR STEPS OUT.pt
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import ckptsup


def main() -> None:
    ckpt_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ckptsup.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=ckpt_dir, save_every_steps=2,
                         allow_stateless_dataloader=True)
    step = run.resume()
    gen = torch.Generator().manual_seed(123)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(steps)]
    while step < steps:
        loss = model(batches[step]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step_done(step, loss=loss.detach())
        step += 1
    run.close()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options),
             "optim": get_optimizer_state_dict(model, opt, options=options)}
    if dist.get_rank() == 0:
        torch.save(state, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
