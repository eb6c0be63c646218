"""Several pictures through the vision tower in one call: the processor's tensors of each picture
(made one picture at a time, ``vision.py``) joined along the dimension that counts pictures, tiles
or patches, so that a step with new images from several requests encodes them together.

Which dimension that is follows from the shapes alone: tensors equal but in their first dimension
join along it (Gemma 3's ``[1, 3, 896, 896]`` pictures, Qwen-VL's ``[patches, 1176]`` and
``[1, 3]`` grids); tensors of one leading item that differ in their second (Idefics3's ``[1, tiles,
3, 512, 512]`` of a picture's tiles) join along that. Anything else is encoded picture by picture.
The vision tower keeps the pictures' order, so its output splits back by each one's token count.
"""

from __future__ import annotations

import torch


def _dimension(tensors: list[torch.Tensor]) -> int | None:
    """The dimension ``tensors`` join along, or None."""
    first = tensors[0].shape
    if not first or any(len(t.shape) != len(first) for t in tensors):
        return None
    if all(t.shape[1:] == first[1:] for t in tensors):
        return 0
    if len(first) >= 2 and all(t.shape[0] == 1 and t.shape[2:] == first[2:] for t in tensors):
        return 1
    return None


def join(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """One vision-tower input of several pictures' inputs (in order), or None when they do not join."""
    keys = parts[0].keys()
    if any(p.keys() != keys for p in parts):
        return None
    out = {}
    for key in keys:
        tensors = [p[key] for p in parts]
        dim = _dimension(tensors)
        if dim is None:
            return None
        out[key] = torch.cat(tensors, dim)
    return out


def groups(parts: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """The pictures (indices into ``parts``) that join, grouped: each with the first of its group."""
    out: list[list[int]] = []
    for i, part in enumerate(parts):
        for group in out:
            if join([parts[group[0]], part]) is not None:
                group.append(i)
                break
        else:
            out.append([i])
    return out
