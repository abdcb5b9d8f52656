"""tradeloop: closed-loop training of distributional deep-RL trading agents."""
__version__ = "0.1.0"
