"""GradientRows is the one gradient path: an indexed row and the query row of the same example agree,
even for a model with dropout left in train mode, and the model's modes and the RNG are given back."""

import torch
from conftest import ROWS
from transformers import LlamaConfig, LlamaForCausalLM

from gradian_lightning import IndexSession, IndexSpec, JsonlDataset, collate, open_index, query_gradients
from gradian_lightning.gradients.loss import supervised_token_loss


def dropout_llama(vocab_size: int) -> LlamaForCausalLM:
    """A tiny random Llama whose attention drops half its weights in train mode."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.5,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).train()


def test_indexed_rows_equal_query_rows_of_a_model_in_train_mode(tmp_path, tokenizer):
    model = dropout_llama(len(tokenizer))
    dataset = JsonlDataset(ROWS, tokenizer, 64)
    batch = {k: v for k, v in collate(dataset.examples).items() if k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():  # the dropout is live: two train-mode forwards give other losses
        assert not torch.equal(supervised_token_loss(model, batch), supervised_token_loss(model, batch))
    # Every submodule's own mode, a mixed one included, must come back as it was.
    model.model.layers[1].eval()
    modes = [m.training for m in model.modules()]
    torch.manual_seed(7)
    rng = torch.get_rng_state()

    session = IndexSession(
        IndexSpec(module_filter=["down_proj", "q_proj"], projection_dim=4, storage_dtype="float32"), tmp_path / "ix"
    )
    session.bind(model)
    session.begin(len(dataset))
    for lo in range(0, len(dataset), 3):
        session.add(collate(dataset.examples[lo : lo + 3]))
    session.finish()
    index = open_index(tmp_path / "ix")
    queries = query_gradients(index, model, tokenizer, ROWS[2:5], batch_size=2)

    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    # The same example, in other batches of other sizes: the same row up to float32 summation order.
    torch.testing.assert_close(queries, index.rows(slice(2, 5)), rtol=1e-4, atol=1e-6)
    # And that row is the eval-mode one: dropout applied to either side would break the equality above.
    model.eval()
    with torch.no_grad():
        losses = supervised_token_loss(model, batch)
    torch.testing.assert_close(torch.from_numpy(index.column("loss")), losses, rtol=1e-5, atol=1e-6)


def test_one_place_builds_a_projector():
    """Rows cannot be made two ways: GradientRows is the package's only KroneckerProjector construction."""
    from pathlib import Path

    import gradian_lightning

    package = Path(gradian_lightning.__file__).parent
    sites = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        for line in path.read_text().splitlines()
        if "KroneckerProjector(" in line
    ]
    assert sites == ["gradients/batch.py"]
