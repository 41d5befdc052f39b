"""Break each PROTOCOL.md rule on purpose, one at a time, and check that its test fails.

Each mutation is an exact text replacement in a copy of ``client_py/`` (the work tree is never
touched); the rule's named tests then run against the copy and at least one must fail.
docs/RULES.md is the table of rules and tests; this file is its executable form.

Usage: python tests/mutations/run.py [-k SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
M = "tabcohort/protocol/machine.py"
U = "tests/unit/test_protocol_rules.py"
S = "tests/sim/test_cohort_sim.py"
D = "tests/runtime/test_driver.py"
SH = "tests/unit/test_shares.py"

# (rule, file, old text, new text, [tests that must catch it])
MUTATIONS: list[tuple[str, str, str, str, list[str]]] = [
    ("ignore messages addressed to another rank", M,
     'if to is not None and to != self.id:', 'if False:',
     [f"{U}::test_message_to_other_rank_is_ignored_entirely"]),
    ("ignore own messages", M,
     'if sender == self.id:\n            return "from_self"', 'if False:\n            return "from_self"',
     [f"{U}::test_message_from_self_is_ignored"]),
    ("hello: foreign version/job ignored", M,
     'if msg["version"] != PROTOCOL_VERSION or msg["job"] != self.job:', 'if msg["version"] != PROTOCOL_VERSION:',
     [f"{U}::test_hello_with_other_version_or_job_is_ignored_and_peer_stays_ignored"]),
    ("member refresh keeps fields a message lacks", "tabcohort/protocol/roster.py",
     'if key in msg:\n                setattr(m, key, msg[key])', 'setattr(m, key, msg.get(key))',
     [f"{U}::test_member_record_refresh_keeps_fields_a_message_lacks"]),
    ("member first seen without ready/running is neither", "tabcohort/protocol/roster.py",
     'ready: bool = False', 'ready: bool = True',
     [f"{U}::test_member_first_seen_without_ready_running_counts_as_neither"]),
    ("round params length checked", M,
     'if t == "round" and len(msg["params"]) != self.worker.bucket_len:', 'if False:',
     [f"{U}::test_round_or_grad_with_wrong_length_is_dropped_and_counted"]),
    ("policy: quorum formula", "tabcohort/protocol/policy.py",
     'quorum = n if n <= 3 else max(2, math.ceil(0.6 * n))', 'quorum = n',
     [f"{U}::test_policy_formula"]),
    ("policy: drop derived from the stretched beat", "tabcohort/protocol/policy.py",
     'drop = max(timing.drop_ms, 4 * beat)', 'drop = timing.drop_ms',
     [f"{U}::test_policy_formula"]),
    ("policy recomputed at heartbeat", M,
     'self.policy = policy(len(self.roster.members) + 1, self.timing)', 'pass',
     [f"{U}::test_policy_is_recomputed_at_heartbeat_from_live_count"]),
    ("live = seen within drop", "tabcohort/protocol/roster.py",
     'if now_ms - m.seen_ms <= drop_ms:', 'if True:',
     [f"{U}::test_members_older_than_drop_are_not_live_and_pruned"]),
    ("cohort: only ready and running members", M,
     'ids = [m.id for m in self.roster.live(now_ms, self.policy.drop_ms) if m.ready and m.running]',
     'ids = [m.id for m in self.roster.live(now_ms, self.policy.drop_ms) if m.ready]',
     [f"{U}::test_stopped_rank_leaves_cohort_at_once"]),
    ("takeover requires now >= deferUntil", M,
     'if now_ms < self.defer_until_ms or not self.has_majority(now_ms):', 'if not self.has_majority(now_ms):',
     [f"{U}::test_takeover_goes_to_the_lowest_id_of_the_most_advanced_lineage"]),
    ("assignment: consecutive windows", "tabcohort/protocol/assign.py",
     'offset += int(batches[k])', 'pass',
     [f"{U}::test_assignment_is_consecutive_windows_mod_2_32"]),
    ("assignment: uses the member's reported batch", M,
     'batches[k] = m.batch if (m is not None and m.batch) else self.worker.batch',
     'batches[k] = self.worker.batch',
     [f"{U}::test_uses_members_reported_batch_for_assignment"]),
    ("collection installed before the round is sent", M,
     '''                                           min(len(awaited), self.policy.quorum), now_ms)
        else:
            self._collection = None
''',
     '''                                           min(len(awaited), self.policy.quorum), now_ms)
        self._collection = None
''',
     [f"{U}::test_collection_installed_before_round_so_fast_bucket_is_kept"]),
    ("own bucket always part of the reduce", M,
     'col.received[self.id] = self._own_bucket', 'pass',
     [f"{U}::test_own_bucket_always_in_reduce_and_quorum_finishes_at_once", f"{U}::test_reduce_is_sample_weighted"]),
    ("collect window bounds the wait", M,
     'self._phase_deadline_ms = now_ms + self.policy.collect_ms', 'self._phase_deadline_ms = None',
     [f"{U}::test_collect_window_arms_after_own_bucket_and_finishes_at_window_end"]),
    ("quorum reached during collect finishes", M,
     '''        if self._phase == "collect" and len(col.received) >= col.quorum:
            self._quorum_reached(col, now_ms)

    def _observe_turnaround''', '''        if False:
            self._quorum_reached(col, now_ms)

    def _observe_turnaround''',
     [f"{U}::test_grad_reaching_quorum_during_collect_finishes"]),
    ("reduce is sample-weighted", M,
     'weights = [s / total for _, s, _ in buckets]', 'weights = [1 / len(buckets) for _ in buckets]',
     [f"{U}::test_reduce_is_sample_weighted"]),
    ("a stopping leader keeps announcing running until its final publish", M,
     '"running": self.running or self._stopping_publish,', '"running": self.running,',
     [f"{U}::test_a_stopping_leader_keeps_announcing_running_until_its_final_publish"]),
    ("leader quantizes its own parameters", M,
     'if q is not None:\n            self.worker.set_params(q)', 'if False:\n            self.worker.set_params(q)',
     [f"{U}::test_leader_replaces_params_with_quantized_values"]),
    ("bucket: step must match", M,
     'if msg["step"] != col.step:', 'if False:',
     [f"{U}::test_bucket_acceptance_rules", f"{S}::test_random_faults_keep_invariants"]),
    ("bucket: sender must be wanted", M,
     'if sender not in col.wanted:', 'if False:',
     [f"{U}::test_bucket_acceptance_rules"]),
    ("bucket: first wins", M,
     'if sender in col.received:\n            self.drops["grad_duplicate"]', 'if False:\n            self.drops["grad_duplicate"]',
     [f"{U}::test_first_bucket_wins_duplicate_dropped"]),
    ("bucket: values finite", M,
     'if not all_finite(g) or not math.isfinite(loss):', 'if False:',
     [f"{U}::test_bucket_acceptance_rules"]),
    ("bucket: positive samples", M,
     'if msg["samples"] != col.shares[sender]:', 'if False:',
     [f"{U}::test_bucket_acceptance_rules"]),
    ("own bucket validated (a NaN never reaches the parameters)", M,
     'if len(g) != self.worker.bucket_len or not all_finite(g) or not math.isfinite(loss) or samples <= 0:',
     'if False:',
     [f"{U}::test_nan_own_bucket_is_dropped_and_peer_buckets_still_apply"]),
    ("pace on transport pressure", M,
     'if self.link.pressure() > 1 and self._pace_tries < _MAX_PACE_TRIES:', 'if False:',
     [f"{U}::test_leader_paces_on_pressure_then_drives_anyway"]),
    ("pacing is bounded (20 beats)", M,
     'if self.link.pressure() > 1 and self._pace_tries < _MAX_PACE_TRIES:', 'if self.link.pressure() > 1:',
     [f"{U}::test_leader_paces_on_pressure_then_drives_anyway"]),
    ("a fault in a round does not end the loop", M,
     'self._phase = "fault"', 'self._phase = None',
     [f"{U}::test_fault_in_round_is_recorded_and_loop_goes_on"]),
    ("unclamped yield between rounds (machine)", M,
     '''        self._phase = "yield"
        self._phase_deadline_ms = now_ms''', '''        self._phase = "yield"
        self._phase_deadline_ms = now_ms + 4''',
     [f"{U}::test_yield_between_rounds_is_due_now_not_a_timer"]),
    ("unclamped yield between rounds (driver)", "tabcohort/runtime/driver.py",
     'self._soon = self.loop.call_soon(self._on_soon)', 'self._soon = self.loop.call_later(0.004, self._on_soon)',
     [f"{D}::test_no_timer_armed_between_rounds_of_a_busy_leader"]),
    ("publish when the run stops", M,
     'if stopped and self.ready and not self.disposed:', 'if False:',
     [f"{U}::test_stop_publishes_once_after_busy_loop_drains"]),
    ("a leader that stands down publishes nothing", M,
     '        self._leading = False\n        self._stopping_publish = False\n',
     '        self._leading = False\n        self._stopping_publish = False\n        self._publish()\n',
     [f"{U}::test_a_deposed_leader_that_returns_never_rewinds_the_new_lineage"]),
    ("hello answered with a beat", M,
     'self._beat(now_ms)       # so the newcomer learns the roster', 'pass',
     [f"{U}::test_hello_is_answered_with_a_broadcast_beat_and_no_params"]),
    ("a leader yields only to a winning lineage (higher term, or same term and lower id)", M,
     'if (term, -sender) < (self.term, -self.id):', 'if sender > self.id:',
     [f"{U}::test_a_leader_yields_only_to_a_winning_lineage", f"{S}::test_a_healed_partition_keeps_the_majority_lineage_and_one_model"]),
    ("reject a round of a stale lineage (lower term)", M,
     'elif term < self.term:\n            self.drops["stale_term"]', 'elif False:\n            self.drops["stale_term"]',
     [f"{U}::test_a_deposed_leader_that_returns_never_rewinds_the_new_lineage"]),
    ("reject a pretender", M,
     'if sender > self.following:\n                self.drops["pretender"]', 'if False:\n                self.drops["pretender"]',
     [f"{U}::test_pretender_round_is_ignored"]),
    ("reject an out-of-order duplicate from the followed leader", M,
     'elif term == self.term and sender == self.following and msg["step"] < self.step:', 'elif False:',
     [f"{U}::test_out_of_order_round_from_followed_leader_is_ignored"]),
    ("do not compare steps across leaders", M,
     'elif term < self.term:\n', 'elif term < self.term or msg["step"] < self.step:\n',
     [f"{U}::test_lower_step_from_a_different_leader_is_adopted"]),
    ("never adopt a round with non-finite parameters", M,
     'if not all_finite(msg["params"]):', 'if False:',
     [f"{U}::test_a_round_with_non_finite_parameters_is_never_adopted"]),
    ("adopt the learning rate", M,
     'self.lr = float(lr)\n        self.ready = True', 'self.ready = True',
     [f"{U}::test_adopt_sets_params_step_lr_ready_and_stops_joining"]),
    ("contribute only when running", M,
     'if self.running and offset is not None:', 'if offset is not None:',
     [f"{U}::test_no_contribution_when_not_running_or_not_assigned"]),
    ("drop a bucket computed against older parameters", M,
     'if seq != self._adopt_seq:\n                self.counters["stale_bucket"]', 'if False:\n                self.counters["stale_bucket"]',
     [f"{U}::test_one_bucket_in_flight_and_stale_bucket_dropped"]),
    ("join: bootstrap only from the second attempt", M,
     'if self._join_attempts >= 2 and', 'if self._join_attempts >= 1 and',
     [f"{U}::test_joiner_announces_every_base_beat_and_bootstraps_on_second_attempt"]),
    ("join: only the lowest running id bootstraps", M,
     'self.id == min([self.id] + [m.id for m in live if m.running])', 'True',
     [f"{U}::test_only_lowest_running_id_bootstraps_and_lower_idle_rank_does_not_block"]),
    ("join: lowest among running peers only", M,
     'self.id == min([self.id] + [m.id for m in live if m.running])', 'self.id == min([self.id] + [m.id for m in live])',
     [f"{U}::test_only_lowest_running_id_bootstraps_and_lower_idle_rank_does_not_block"]),
    ("join: no bootstrap while a live peer is ready", M,
     'if any(m.ready for m in live):\n            return', 'pass',
     [f"{U}::test_joiner_does_not_bootstrap_while_a_live_peer_is_ready"]),
    ("takeover after the takeover window", M,
     'elif now_ms - self.last_open_ms > self.policy.takeover_ms and self._may_take_lead(now_ms):',
     'elif self._may_take_lead(now_ms):',
     [f"{U}::test_a_takeover_starts_a_new_term_above_every_term_seen",
      f"{U}::test_a_lower_id_joiner_never_takes_the_lead_while_rounds_flow"]),
    ("a takeover starts a new term", M,
     'self.term = max([self.term] + seen) + 1', 'self.term = max([self.term] + seen)',
     [f"{U}::test_a_takeover_starts_a_new_term_above_every_term_seen"]),
    ("takeover only by the most advanced lineage", M,
     'best = max((t, st) for t, st, _ in cands)', 'best = (self.term, self.step)',
     [f"{U}::test_takeover_goes_to_the_lowest_id_of_the_most_advanced_lineage"]),
    ("lead and take over only with a majority of the membership", M,
     'return 2 * len(visible) > len(members) or', 'return True or',
     [f"{U}::test_a_leader_without_a_majority_commits_nothing_and_resumes_when_it_sees_one",
      f"{S}::test_a_healed_partition_keeps_the_majority_lineage_and_one_model"]),
    ("an even split goes on only on the lowest member's side", M,
     'and min(members) in visible)', ')',
     [f"{U}::test_an_even_split_goes_on_only_on_the_side_of_the_lowest_member",
      f"{S}::test_one_against_one_picks_the_lowest_members_side_and_both_end_on_it"]),
    ("apply a round only with a majority when it finishes", M,
     'if buckets and not self.has_majority(now_ms):', 'if False:',
     [f"{U}::test_a_leader_without_a_majority_commits_nothing_and_resumes_when_it_sees_one"]),
    ("the witness: a rank whose link closed leaves the membership at once", M,
     '        self.membership.pop(rank_id, None)\n', '',
     [f"{U}::test_a_rank_that_left_leaves_the_membership_at_once_and_frees_the_survivor"]),
    ("a rank that says it stopped leaves the membership", M,
     'self.membership.pop(sender, None)          # it stopped: it left', 'pass',
     [f"{U}::test_a_rank_that_left_leaves_the_membership_at_once_and_frees_the_survivor"]),
    ("a member silent for policy.forget leaves the membership", M,
     'if now_ms - t > self.policy.forget_ms]', 'if False]',
     [f"{U}::test_a_rank_that_left_leaves_the_membership_at_once_and_frees_the_survivor"]),
    ("an overflowing update is not applied", M,
     'if not all_finite(after):', 'if False:',
     [f"{U}::test_an_update_that_overflows_is_not_applied_published_or_counted_as_a_step"]),
    ("a returning evicted rank is assigned but not awaited (probation)", M,
     'awaited = {k for k in shares if k not in self._probation and k not in probing}',
     'awaited = set(shares)',
     [f"{U}::test_an_evicted_rank_that_returns_is_assigned_but_not_awaited_until_it_keeps_up"]),
    ("bucket: term must match", M,
     'if msg["term"] != col.term:', 'if False:',
     [f"{U}::test_a_bucket_of_another_term_is_dropped"]),
    ("suspension: a long gap clears ready", M,
     'if gap > self.policy.drop_ms and (self.ready or self.looping):', 'if False:',
     [f"{U}::test_suspended_rank_clears_ready_and_rejoins", f"{U}::test_resumed_leader_does_not_rewind_cohort"]),
    ("a stopped rank leaves the cohort (stop clears running)", M,
     '        self.running = False\n        self.joining = False\n        self._leading = False\n        if was_leader',
     '        self.joining = False\n        self._leading = False\n        if was_leader',
     [f"{U}::test_stop_beats_and_reports"]),
    ("becoming ready is announced with a beat at once (PROTOCOL-NOTES 2)", M,
     "            self._beat(now_ms)\n            self._take_lead(now_ms)",
     "            self._take_lead(now_ms)",
     [f"{U}::test_becoming_ready_is_announced_with_a_beat_at_once"]),
    ("grace window bounded by a fraction of the round's elapsed time (PROTOCOL-NOTES 7)", M,
     'self.grace_fraction * (now_ms - col.opened_ms))', 'math.inf)',
     [f"{U}::test_grace_window_is_bounded_by_elapsed_fraction_and_collect_window"]),
    ("grace: finish at once when every awaited bucket arrived", M,
     'if all(k in col.received or missed.get(k, 0) >= _GRACE_SKIP_MISSES for k in col.awaited):',
     'if False:',
     [f"{U}::test_grace_waits_briefly_after_quorum_and_finishes_when_all_arrived"]),
    ("grace window covers the typical arrival spread of previous rounds (PROTOCOL-NOTES 7)", M,
     'grace = min(max(spread, self.grace_margin * typical),', 'grace = min(spread,',
     [f"{U}::test_grace_window_covers_the_typical_spread_of_previous_rounds_late_buckets_included"]),
    ("grace: a bucket that arrives after its round finished still counts in the typical spread", M,
     'if prev is not None and msg["step"] == prev.step and msg["from"] in prev.missing:', 'if False:',
     [f"{U}::test_grace_window_covers_the_typical_spread_of_previous_rounds_late_buckets_included"]),
    ("grace: a rank that missed the last two rounds is not awaited (PROTOCOL-NOTES 7)", M,
     'missed.get(k, 0) >= _GRACE_SKIP_MISSES', 'missed.get(k, 0) >= 10**9',
     [f"{U}::test_grace_does_not_wait_for_a_rank_that_missed_the_last_two_rounds",
      f"{S}::test_grace_rule_keeps_late_buckets_of_equally_fast_ranks_and_ignores_a_10x_straggler"]),
    ("grace: a zero window ends at a deadline, not at once", M,
     '            col.grace_until_ms = now_ms + max(0.0, grace)\n',
     '            col.grace_until_ms = now_ms + max(0.0, grace)\n            if grace <= 0:\n'
     '                return self._finish_round(now_ms)\n',
     [f"{U}::test_grace_zero_window_still_takes_buckets_that_arrive_at_the_same_instant"]),
    ("shares: equal finish times (a_k + b_k s_k = T)", "tabcohort/protocol/shares.py",
     'share = {k: (T - models[k][0]) / models[k][1] for k in active}',
     'share = {k: left / len(active) for k in active}',
     [f"{SH}::test_shares_follow_speed_and_equalise_finish_times",
      f"{S}::test_heterogeneous_cohorts_apply_nearly_the_sum_of_their_ranks_solo_throughput"]),
    ("shares: no share for a rank whose one sample would arrive last by far", "tabcohort/protocol/shares.py",
     'if late and len(active) + len(fixed) > 1:', 'if False:',
     [f"{SH}::test_shares_cover_the_global_batch_within_caps_once",
      f"{SH}::test_a_rank_whose_one_sample_would_arrive_last_by_far_gets_no_share_and_is_probed",
      f"{S}::test_a_tab_like_rank_never_slows_the_cohort"]),
    ("shares: within each rank's cap", "tabcohort/protocol/shares.py",
     'over = [k for k in active if share[k] > caps[k]]', 'over = []',
     [f"{SH}::test_a_capped_rank_takes_its_cap_and_the_others_split_the_rest_by_speed"]),
    ("shares: consecutive windows from the cursor", "tabcohort/protocol/assign.py",
     'offset += int(shares[k])', 'offset += 1',
     [f"{SH}::test_shares_cover_the_global_batch_within_caps_once",
      f"{S}::test_heterogeneous_cohort_with_joins_leaves_kills_and_a_20x_speed_change_keeps_invariants"]),
    ("shares: the cursor continues across rounds and leaders", M,
     'self.cursor = int(msg["cursor"]) + sum(shares.values())', 'self.cursor = int(msg["cursor"])',
     [f"{SH}::test_a_follower_computes_exactly_its_share_and_continues_the_cursor"]),
    ("bucket: samples must equal the sender's share", M,
     'if msg["samples"] != col.shares[sender]:', 'if msg["samples"] <= 0:',
     [f"{SH}::test_a_bucket_that_does_not_cover_exactly_its_share_is_dropped"]),
    ("shares: a follower computes exactly its share", M,
     "int(shares.get(self.id, self.worker.batch)))", "self.worker.batch)",
     [f"{SH}::test_a_follower_computes_exactly_its_share_and_continues_the_cursor"]),
    ("shares: turnaround feeds the speed table", M,
     '        self.speeds.observe(rank, samples, now_ms - sent[0])\n', '',
     [f"{SH}::test_buckets_turnaround_feeds_the_speeds_and_the_shares_follow",
      f"{S}::test_a_tab_like_rank_never_slows_the_cohort"]),
    ("a leader at the job's step limit drives no further round; it stops and publishes (PROTOCOL-NOTES 13)", M,
     'if self.at_step_limit and self.is_leader(now_ms):', 'if False:',
     [f"{U}::test_a_step_limit_ends_the_cohort_at_exactly_that_step"]),
    ("a follower that adopts a round at the step limit stops and computes nothing (PROTOCOL-NOTES 13)", M,
     'if self.at_step_limit and self.running:', 'if False:',
     [f"{U}::test_a_step_limit_ends_the_cohort_at_exactly_that_step"]),
    ("dispose stops message handling", M,
     'if self.disposed:\n            return True', 'if False:\n            return True',
     [f"{U}::test_dispose_stops_everything"]),
    ("a round in flight stops waiting for a rank that left (the witness)", M,
     'if col is not None and rank_id in col.wanted and rank_id not in col.received:',
     'if False:',
     [f"{U}::test_a_round_in_flight_stops_waiting_for_a_rank_that_left"]),
]


SIM_ONLY = [
    ("after the leader is killed, the first round from the new leader comes within drop + takeover + 2 beats",
     f"{S}::test_killed_leader_is_replaced_within_bound"),
    ("a late joiner is synced by one round (adopt is idempotent and order-independent)",
     f"{S}::test_late_joiner_is_synced_by_one_round"),
    ("islands merge under the lowest id", f"{S}::test_islands_merge_under_lowest_id"),
    ("a healed partition keeps the majority's lineage; one model at the end",
     f"{S}::test_a_healed_partition_keeps_the_majority_lineage_and_one_model"),
    ("random partition patterns and heal times: one leader, one model, no rewind of a strict majority",
     f"{S}::test_random_partitions_end_with_one_leader_one_model_and_no_majority_rewind"),
    ("heterogeneous cohorts: 16 ranks with speeds spread 20x keep >= 90 % of their solo throughput (virtual time)",
     f"{S}::test_sixteen_ranks_with_speeds_spread_twentyfold_keep_their_efficiency"),
    ("a rank awake 1 s a minute does not stall the cohort (probation)",
     f"{S}::test_a_rank_awake_one_second_a_minute_does_not_stall_the_cohort"),
    ("a suspended leader that resumes does not rewind the cohort",
     f"{S}::test_suspended_leader_that_resumes_does_not_rewind_the_cohort"),
    ("every applied step is reduced only from buckets of that step; all ranks bit-identical after stop",
     f"{S}::test_random_faults_keep_invariants"),
    ("the driver yields between rounds without arming a timer", f"{D}::test_no_timer_armed_between_rounds_of_a_busy_leader"),
    ("a failure inside a round becomes fault; the loop goes on", f"{D}::test_worker_failure_becomes_fault_and_loop_goes_on"),
]


def markdown() -> str:
    lines = ["# PROTOCOL.md rules and the tests that catch them", "",
             "Generated by `python tests/mutations/run.py --markdown`. Each row of the first table is a",
             "mutation that `tests/mutations/run.py` applies to a copy of `client_py/` (the rule broken on",
             "purpose); at least one named test must then fail. CI runs it as the `mutations` tier.", "",
             "| # | rule | where it is broken | tests that must fail |", "|---|---|---|---|"]
    for i, (rule, rel, _, _, tests) in enumerate(MUTATIONS, 1):
        names = "<br>".join(f"`{t.split('::')[0].split('/')[-1]}::{t.split('::')[1]}`" for t in tests)
        lines.append(f"| {i} | {rule} | `{rel}` | {names} |")
    lines += ["", "Properties checked end to end by the seeded simulation and the driver tests (invariants read",
              "from the in-memory network's own delivery log):", "", "| property | test |", "|---|---|"]
    for prop, t in SIM_ONLY:
        lines.append(f"| {prop} | `{t.split('::')[0].split('/')[-1]}::{t.split('::')[1]}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutations whose rule contains this text")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print docs/RULES.md")
    a = ap.parse_args()
    muts = [m for m in MUTATIONS if a.k in m[0]]
    if a.markdown:
        print(markdown(), end="")
        return 0
    rules_md = REPO / "docs" / "RULES.md"
    if not a.k and (not rules_md.exists() or rules_md.read_text() != markdown()):
        print("docs/RULES.md is out of date: python tests/mutations/run.py --markdown > docs/RULES.md")
        return 1
    if a.list:
        for rule, f, _, _, tests in muts:
            print(f"{rule}: {f} -> {', '.join(tests)}")
        return 0
    survived = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rule, rel, old, new, tests) in enumerate(muts, 1):
            src = pathlib.Path(tmp) / f"m{i}"
            shutil.copytree(REPO / "client_py", src, ignore=shutil.ignore_patterns("__pycache__"))
            path = src / rel
            text = path.read_text()
            if text.count(old) != 1:
                print(f"[{i:2d}] {rule}: PATCH DOES NOT APPLY ({text.count(old)} matches) in {rel}")
                survived.append(rule)
                continue
            path.write_text(text.replace(old, new))
            env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{REPO / 'server'}",
                       TABCOHORT_EXPECT_SRC=str(src))
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout=300",
                   "-o", "addopts=", *tests]
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            caught = r.returncode == 1
            print(f"[{i:2d}] {'caught  ' if caught else 'SURVIVED'} {rule}")
            if not caught:
                survived.append(rule)
                print(r.stdout[-1500:], r.stderr[-800:])
    print(f"{len(muts) - len(survived)}/{len(muts)} mutations caught in {time.time() - t0:.0f} s")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
