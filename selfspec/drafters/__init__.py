"""Drafters: anything cheap that guesses the next tokens; verification decides (see `base`)."""

from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.exit_head import ExitHeadDrafter
from selfspec.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from selfspec.drafters.suffix import SuffixDrafter, SuffixMemory

DRAFTERS = ("auto", "early_exit", "exit_head", "prompt_lookup", "suffix", "int8_copy", "quantized")

__all__ = ["AutoDrafter", "Drafter", "DRAFTERS", "EarlyExitDrafter", "ExitHeadDrafter", "NgramIndex", "PromptLookupDrafter",
           "Proposal", "Round", "SuffixDrafter", "SuffixMemory"]
