"""A toy text-generation service, for `memfit doctor --serve` (docs/doctor.md): `handle` serves one request into
one cache the service makes on its first request and reuses; `handle_sessions` keeps every request's cache under
its session id for a follow-up that never comes, the way a service's memory grows with its requests."""
import itertools

import torch

torch.manual_seed(0)
VOCAB, WIDTH, CONTEXT, NEW = 100, 64, 32, 8
embed = torch.nn.Embedding(VOCAB, WIDTH)
head = torch.nn.Linear(WIDTH, VOCAB)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
CACHE = None
SESSIONS = {}
_session_ids = itertools.count()


def _generate(cache: torch.Tensor, tokens: list[int]) -> list[int]:
    """Greedy decoding with one toy attention over the cached tokens."""
    tokens = list(tokens)
    for t in range(len(PROMPT) + NEW - 1):
        cache[t] = embed(torch.tensor(tokens[t]))
        weights = torch.softmax(cache[: t + 1] @ cache[t], dim=0)
        if t >= len(PROMPT) - 1:
            tokens.append(int(head(weights @ cache[: t + 1]).argmax()))
    return tokens[-NEW:]


@torch.no_grad()
def handle() -> list[int]:
    global CACHE
    if CACHE is None:
        CACHE = torch.zeros(CONTEXT, WIDTH)
    return _generate(CACHE, PROMPT)


@torch.no_grad()
def handle_sessions() -> list[int]:
    cache = torch.zeros(CONTEXT, WIDTH)
    SESSIONS[next(_session_ids)] = cache
    return _generate(cache, PROMPT)
