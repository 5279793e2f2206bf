"""The request side: the scheduler (THE generation loop), requests and their events, sampling,
constrained decoding, log-probabilities, the prefix cache, `hetmoe batch`'s job."""
