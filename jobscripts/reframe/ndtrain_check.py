# ReFrame 4.x regression check of ndtrain: trains the tiny deck (inputs/tiny.toml) with the
# repository's binary under the partition's MPI launcher and judges the run from the
# run.json it writes: the run finished, every rank took part, the final loss is below a
# threshold, and the throughput (tokens/s over the whole job) is a performance variable whose
# reference each partition states in the settings (extras['ndtrain_reference']).
#
#   reframe -C jobscripts/reframe/settings.py -c jobscripts/reframe/ndtrain_check.py -r
#
# Variables (set with -S NAME=VALUE): ndtrain (the binary), steps, threads, max_final_loss;
# num_tasks for the number of ranks.

import json
import os

import reframe as rfm
import reframe.utility.sanity as sn
from reframe.core.builtins import performance_function, run_after, run_before, sanity_function, variable
from reframe.core.exceptions import SanityError

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))


def _default_binary():
    '''$NDTRAIN_BIN (a relative path is taken from the repository's root: ReFrame loads checks
    from their own folder), else the release build, else the debug build (what `cargo test`
    builds).'''
    if os.environ.get('NDTRAIN_BIN'):
        return os.path.join(REPO, os.environ['NDTRAIN_BIN'])
    for profile in ('release', 'debug'):
        path = os.path.join(REPO, 'target', profile, 'ndtrain')
        if os.path.exists(path):
            return path
    return os.path.join(REPO, 'target', 'release', 'ndtrain')


@sn.deferrable
def _field(path, *keys):
    '''A field of a JSON file, read when the check evaluates it.'''
    with open(path) as f:
        value = json.load(f)
    for k in keys:
        value = value[k]
    return value


@rfm.simple_test
class NdtrainTinyCheck(rfm.RunOnlyRegressionTest):
    descr = 'ndtrain trains the tiny deck: it finishes, learns, and keeps its speed'
    valid_systems = ['*']
    valid_prog_environs = ['*']
    tags = {'ndtrain', 'tiny', 'ci'}
    maintainers = ['ndtrain']

    #: The ndtrain binary.
    ndtrain = variable(str, value=_default_binary())
    #: The input deck.
    deck = variable(str, value=os.path.join(REPO, 'inputs', 'tiny.toml'))
    #: Optimiser steps (the deck's own: 150).
    steps = variable(int, value=150)
    #: Threads per rank (`[run] threads`; 0 = the node's cores divided by its ranks).
    threads = variable(int, value=1)
    #: The final loss must be below this. The tiny deck's synthetic data has an entropy floor of
    #: 1.2425 nats/token; 150 steps end at 1.334 on every layout (the layouts agree to 1e-6).
    max_final_loss = variable(float, value=1.5)
    #: No loss can be far below the data's entropy floor: a lower one means a broken loss.
    min_final_loss = variable(float, value=1.0)

    num_tasks = 2
    num_cpus_per_task = 1
    time_limit = '10m'
    keep_files = ['out/run.json', 'out/metrics.csv', 'out/deck.toml']

    # The reference of `tokens_per_s` (global tokens per second: tokens per step / mean step
    # time) comes from the partition's `extras['ndtrain_reference']` in the settings, as
    # {'tokens_per_s': (value, lower, upper, 'tokens/s')}: each site states its own. A partition
    # without one reports the throughput without judging it.

    @run_after('init')
    def set_executable(self):
        self.executable = self.ndtrain

    @run_before('run')
    def set_options(self):
        self.executable_opts = [
            'train',
            self.deck,
            '--set', f'run.steps={self.steps}',
            '--set', f'run.threads={self.threads}',
            '--set', "'run.out_dir=\"out\"'",
        ]
        self.job.launcher.options += self.current_partition.extras.get('launcher_options', [])

    @run_before('performance')
    def set_reference(self):
        ref = self.current_partition.extras.get('ndtrain_reference')
        if ref:
            self.reference = {self.current_partition.fullname: {k: tuple(v) for k, v in ref.items()}}

    @property
    def run_json(self):
        return os.path.join(self.stagedir, 'out', 'run.json')

    @sanity_function
    def validate(self):
        if not os.path.exists(self.run_json):
            raise SanityError(f'no {self.run_json}: ndtrain did not start training (see the stderr in the stage folder)')
        with open(self.run_json) as f:
            rec = json.load(f)
        res = rec.get('results') or {}
        ranks = sorted(r for rs in rec['job']['hosts'].values() for r in rs)
        loss = res.get('final_loss')
        return sn.all([
            sn.assert_eq(self.job.exitcode, 0, msg='ndtrain exited with {0}'),
            sn.assert_eq(rec['status'], 'finished', msg='run.json status: {0}'),
            sn.assert_eq(res.get('steps_run'), self.steps, msg='steps run: {0}, expected {1}'),
            sn.assert_eq(rec['job']['world_size'], self.num_tasks, msg='world size {0}, expected {1}'),
            sn.assert_eq(ranks, list(range(self.num_tasks)), msg='hosts cover ranks {0}, expected {1}'),
            sn.assert_true(loss is not None, msg='no final loss'),
            sn.assert_bounded(loss if loss is not None else float('nan'), self.min_final_loss, self.max_final_loss,
                              msg='final loss {0} outside [{1}, {2}]'),
            sn.assert_found(r'final loss \S+ vs entropy floor', self.stdout),
        ])

    @performance_function('tokens/s')
    def tokens_per_s(self):
        return _field(self.run_json, 'results', 'tokens_per_s')

    @performance_function('s')
    def mean_step_s(self):
        return _field(self.run_json, 'results', 'mean_step_s')

    @performance_function('nats')
    def final_loss(self):
        return _field(self.run_json, 'results', 'final_loss')

    @performance_function('')
    def mfu(self):
        return _field(self.run_json, 'results', 'mfu')
