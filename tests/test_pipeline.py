"""`pipeline.make_engine`: each engine of `spectot solve` gets the draft set-up its flags ask for."""

from __future__ import annotations

import torch

from spectot.config import DraftOptions, ModelOptions
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
from spectot.pipeline import Pipeline, make_engine
from spectot.spec.trees.dynamic import PCTPolicy


def test_a_pct_engine_verifies_only_the_tree_size_this_machine_pays_for(tiny_checkpoint, tiny_model, tmp_path):
    """`solve --engine sd --tree pct`: the engine's PCT policy gets t(n), as `Pipeline.from_options` gives it."""
    target = tiny_model("llama", 0)  # the checkpoint's weights
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    costs = {"t_curve": [{"n": 1, "t": 1.0}, {"n": 8, "t": 1.2}, {"n": 64, "t": 4.0}], "draft_cost": 0.1}
    draft = DraftOptions(draft=str(tmp_path / "edd"), tree="pct", adaptive_k=False)
    engine, method = make_engine(pipe, "sd", draft, model, costs)
    policy = engine.decoder.proposer.policy
    assert method == "sd" and isinstance(policy, PCTPolicy)
    assert policy.verify_cost is not None and policy.verify_cost(8) == 1.2
    chain, _ = make_engine(pipe, "sd", DraftOptions(draft=str(tmp_path / "edd"), adaptive_k=False), model, costs)
    assert not isinstance(chain.decoder.proposer.policy, PCTPolicy)  # --tree auto: sd drafts chains
