"""data_ddp.py with ckptsup's hooks: attach(model, optimizer) and step_done each step, so its ranks
say hello and are supervised at the hooks level; the same data, stalls and prints."""
import ckptsup

import data_ddp

if __name__ == "__main__":
    data_ddp.main(hooks=ckptsup)
