"""Real acceptance with the target in this process (`launcher eval`): the one package that imports
both roles, the target's model and decode session and the drafter's decoding loop. The workers never
import it: during training the target workers verify (services/drafter/acceptance/remote_eval.py)."""
