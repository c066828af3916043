"""An OpenEnv environment class, written for OpenEnv and unaware of loopline, trained by loopline (multi-turn):

    loopline train env.name=openenv:examples/openenv_guess.py env.max_turns=4

Guess a digit: each wrong guess is told "higher" or "lower", a right one earns 1 and ends the episode; four
guesses at most. loopline makes a fresh GuessNumber per episode in the env workers, resets it with the row's seed
(the same seed makes the same digit: loopline replays episodes) and turns the model's text into a GuessAction (its
one field, `guess: int`, parsed from the text; a turn that is not a number ends the episode with reward 0).
"""

import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self._digit = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._digit = random.Random(seed).randint(0, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess my digit (0-9):")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._digit:
            return GuessObservation(message="right", done=True, reward=1.0)
        hint = "higher" if action.guess < self._digit else "lower"
        return GuessObservation(message=f"{hint}; guess again:", done=self._state.step_count >= 4, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
