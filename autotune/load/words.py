"""The words synthetic text prompts are made of (one token each after a space in common BPE vocabularies)."""

from __future__ import annotations

# Common short words: one token each in GPT-2/Llama/Qwen-style BPE vocabularies when preceded by a space.
_WORD_TEXT = """
the of and to in is it that was for on are as with his they at be this from have or by one had not
    but what all were when we there can an your which their said if do will each about how up out them then
    she many some so these would other into has more her two like him see time could no make than first
    been its who now people my made over did down only way find use may water long little very after words
    called just where most know get through back much go good new write our me man too any day same right
    look think also around another came come work three word must because does part even place well such
    here take why things help put years different away again off went old number great tell men say small
    every found still between name should home big give air line set own under read last never us left end
    along while might next sound below saw something thought both few those always looked show large often
    together asked house world going want school important until form food keep children feet land side
    without boy once animals life enough took sometimes four head above kind began almost live page got
    earth need far hand high year mother light parts country father let night following picture being study
    second eyes soon times story boys since white days ever paper hard near sentence better best across
    during today others however sure means knew try told young miles sun ways thing whole hear example heard
    several change answer room sea against top turned learn point city play toward five using himself usually
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
"""The words of synthetic text prompts (calibrated per tokenizer by :mod:`autotune.load.calibrate`)."""
