"""Random paged KV caches and scattered page tables for the attention kernel tests."""

import torch


def random_caches(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, device, generator):
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
    return k, v


def scattered_page_table(lengths: list[int], page_size: int, num_pages: int, device, generator) -> torch.Tensor:
    """[B, max_pages + 2] int32: each request's pages drawn in random order from one shuffled pool.

    Entries past a request's last page point at random pages (some other request's data),
    so a kernel that reads past a context gets a wrong answer rather than zeros.
    """
    needed = [-(-n // page_size) for n in lengths]
    if sum(needed) > num_pages:
        raise ValueError(f"{sum(needed)} pages needed, the pool has {num_pages}")
    pool = torch.randperm(num_pages, generator=generator).tolist()
    width = max(needed, default=0) + 2
    table = torch.randint(0, num_pages, (len(lengths), width), generator=generator, dtype=torch.int32)
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return table.to(device)


def as_fp8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The caches in float8 with unequal power-of-two scales per kv head, as the engine keeps them:
    (k8, v8, k_scale, v_scale). Values span several binades, so every head's scale matters."""
    heads = k_cache.shape[2]
    k_scale = torch.tensor([2.0 ** (h % 3 - 2) for h in range(heads)], device=k_cache.device)
    v_scale = torch.tensor([2.0 ** (1 - h % 2) for h in range(heads)], device=k_cache.device)
    k8 = (k_cache.float() * 3 / k_scale[:, None]).to(torch.float8_e4m3fn)
    v8 = (v_cache.float() * 2 / v_scale[:, None]).to(torch.float8_e4m3fn)
    return k8, v8, k_scale, v_scale
