"""Secrets out of what the run keeps: redact_tree on a server's /server_info reply (opid_mega.infra.redact)."""
from opid_mega.infra.redact import MASK, redact_tree

KEY = "k3y-Secret-42xyz"


def server_info():
    """The shape of SGLang's /server_info: the server arguments flat, plus a launch command as a list and as text."""
    return {"tp_size": 2, "api_key": KEY, "admin_api_key": None, "max_total_tokens": 4096, "tokenizer_path": "/m",
            "argv": ["python", "-m", "sglang.launch_server", "--model-path", "/m", f"--api-key={KEY}",
                     "--max-total-tokens", "4096"],
            "launch_command": f"python -m sglang.launch_server --api-key {KEY} --skip-tokenizer-init --tp 2",
            "nested": [{"hf_token": "hf_abcdef"}, f"log line with {KEY} in it"]}


def test_redact_tree_masks_keys_flags_and_known_secrets_only():
    out = redact_tree(server_info(), [KEY])
    assert KEY not in repr(out) and "hf_abcdef" not in repr(out)
    assert out["api_key"] == MASK and out["admin_api_key"] is None  # nothing to mask is left as it is
    assert out["nested"][0]["hf_token"] == MASK
    assert out["argv"][5] == f"--api-key={MASK}" and out["argv"][6:] == ["--max-total-tokens", "4096"]
    assert out["launch_command"] == f"python -m sglang.launch_server --api-key {MASK} --skip-tokenizer-init --tp 2"
    assert out["nested"][1] == f"log line with {MASK} in it"
    # names that only contain a secret word are no secrets
    assert out["max_total_tokens"] == 4096 and out["tokenizer_path"] == "/m" and out["tp_size"] == 2
    # without the key given, the flag and key rules still catch it
    bare = redact_tree(server_info())
    assert KEY not in repr({k: v for k, v in bare.items() if k != "nested"})

