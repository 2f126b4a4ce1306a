"""Write new K/V rows into the paged cache."""
import torch


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hk, D]; caches [num_pages, page_size, Hk, D]; slot = page * page_size + offset, -1 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
