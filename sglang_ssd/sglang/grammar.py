"""Grammar-constrained decoding (json_schema / regex / ebnf / structural tags) in the chain verify.

Plain SGLang masks the target's logits with the request's grammar before it samples each token.
Speculation must sample every chain position from that same masked distribution, so before the
acceptance step the verify logits of a chain [root, d_1..d_K] are masked row by row:

  row j (the target's distribution for the token after d_j) gets the grammar's allowed-token mask
  in the state reached by accepting d_1..d_j after the committed prefix.

SGLang's own helpers do the walk (``spec_utils.build_grammar_vocab_mask`` over a
``GrammarTree.from_linear_chain``, the code its EAGLE and DFlash verifiers use): for each request the
matcher advances along the drafted tokens while each is allowed by the previous row's mask, fills
that row's mask, then rolls back to the committed prefix.  Rows after the first forbidden draft
token keep the unconstrained mask; they are never used, because that draft token has target
probability 0 under the masked previous row and is rejected there (greedy: it cannot be the argmax;
T > 0: p(d) = 0 so it is rejected with probability 1 and the bonus is drawn from the residual of
the masked row).  The committed tokens then advance the real FSM in SGLang's own result processing
(``advance_grammar_fsm``), which also drops tokens past the grammar's end, as for EAGLE.

Unconstrained requests in the same batch keep all-allowed rows, so mixed batches work.  The draft
does not see the grammar: its q is the distribution it really sampled from, so exactness holds;
constrained requests simply accept less often where the draft proposes forbidden tokens.
"""

from __future__ import annotations

import torch


def mask_chain_logits(batch, chain: torch.Tensor, logits: torch.Tensor, barrier=None) -> bool:
    """Mask ``logits`` [bs * n, V] (chain layout, in place) with each constrained request's grammar.

    chain: [bs, n] int64 on the host (the walk runs there; a device copy would wait for the verify),
    column 0 the committed root token.  Returns whether a mask was applied.
    """
    if not batch.has_grammar:
        return False
    from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

    mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=GrammarTree.from_linear_chain(chain.cpu()),
                                    sampling_info=batch.sampling_info, device=logits.device, barrier=barrier)
    if mask is not None:
        mask.apply(logits)
    return mask is not None
