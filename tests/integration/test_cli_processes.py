"""The user-facing commands as real processes: pdctl make-model, then a chat through the engine."""

from __future__ import annotations

import subprocess
import sys


def test_make_model_then_chat(tmp_path) -> None:
    model = tmp_path / "tiny"
    made = subprocess.run([sys.executable, "-m", "pdctl.cli", "make-model", str(model), "--seed", "0"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    chat = subprocess.run([sys.executable, "-m", "engine.chat", "--model", str(model), "--max-tokens", "8",
                           "Hello cluster"], capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    assert "assistant> " in chat.stdout
    assert "8 generated" in chat.stdout


def test_chat_with_a_missing_model_fails_clearly(tmp_path) -> None:
    chat = subprocess.run([sys.executable, "-m", "engine.chat", "--model", str(tmp_path / "nope"), "hi"],
                          capture_output=True, text=True, timeout=120)
    assert chat.returncode != 0
    assert "no config.json" in chat.stderr
