"""The black-box API tests (tests/router/test_api.py, test_compat.py, test_errors.py's
router-only ones) against the bed: the router, the workers and Redis on hosts of their own,
every link 1 Gbit/s. Same assertions, tokens equal to the in-process engine's."""

from tests.router.test_api import (  # noqa: F401 (collected here, with the bed's fixtures)
    test_async_client_concurrent_streams,
    test_chat_whole_and_streamed,
    test_greedy_completion_equals_the_engine,
    test_models_health_version_openapi,
    test_prompt_forms_echo_and_logprobs,
    test_seeded_n2_completion_stream_equals_whole,
    test_stop_string_cuts_the_text,
    test_usage_equals_the_tokenize_endpoint,
)
from tests.router.test_compat import (  # noqa: F401
    test_best_of_returns_the_best_by_cumulative_logprob,
    test_cached_tokens_count_only_what_was_there_before,
    test_continuous_usage_stats,
    test_logprobs_zero_gives_the_chosen_token,
)
from tests.router.test_errors import (  # noqa: F401
    test_bad_completion_fields_are_400_naming_the_field,
    test_malformed_json_and_non_objects_are_400,
    test_unknown_model_is_404,
)
