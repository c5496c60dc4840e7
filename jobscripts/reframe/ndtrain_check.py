# ReFrame 4.x regression checks of ndtrain, judged from the run.json each run writes: the run
# finished, every rank took part, the loss is sane, and the throughput (tokens/s over the whole
# job) is a performance variable with a reference per system and partition.
#
#   reframe -C jobscripts/reframe/settings.py -c jobscripts/reframe/ndtrain_check.py -r
#
# Which partitions and environments run them is decided by features, as a centre's settings
# declare them: a partition with feature `mpi` (and `gpu` for the GPU check), an environment
# with feature `ndtrain`. The executable is `ndtrain` from PATH: the environment's or the
# check's `modules` (default: the module `ndtrain`; `-S modules=` for none) put it there.
# The decks are the check's own resources (src/ beside this file), copied into the stage.
#
#   NdtrainTinyCheck     the tiny deck on 2 ranks: finishes, learns (CI runs it)
#   NdtrainScalingCheck  bench_small over 1, 2 and 4 ranks (FSDP, the same global batch)
#   NdtrainGpuCheck      gpu_1b on the GPUs of one node (partitions with feature `gpu`)
#
# References: the partition's extras['ndtrain_reference'] in the settings, by case
# ('tiny', 'bench_small@<ranks>', 'gpu_1b'), each {'tokens_per_s': (value, lower, upper,
# 'tokens/s')}. A partition without one reports the throughput without judging it.
#
# Variables (set with -S NAME=VALUE): steps, threads, max_final_loss, modules.

import json
import os

import reframe as rfm
import reframe.utility.sanity as sn
import reframe.utility.typecheck as typ
from reframe.core.builtins import parameter, performance_function, run_after, run_before, sanity_function, variable
from reframe.core.exceptions import SanityError


@sn.deferrable
def _field(path, *keys):
    '''A field of a JSON file, read when the check evaluates it.'''
    with open(path) as f:
        value = json.load(f)
    for k in keys:
        value = value[k]
    return value


class NdtrainBase(rfm.RunOnlyRegressionTest):
    '''One ndtrain training run of a deck from src/, judged from its run.json.'''

    valid_systems = ['+mpi']
    valid_prog_environs = ['+ndtrain']
    maintainers = ['ndtrain']
    sourcesdir = 'src'
    executable = 'ndtrain'
    time_limit = '10m'
    keep_files = ['out/run.json', 'out/metrics.csv', 'out/deck.toml']

    #: Modules that put `ndtrain` on PATH: a site's `ndtrain` module (`-S modules=` where the
    #: environment already does; the local settings' modules system ignores it).
    modules = ['ndtrain']
    #: Threads per rank (`[run] threads`; 0 = the CPUs of each rank's binding).
    threads = variable(int, value=1)
    #: Extra deck overrides (`table.key=value`), after the check's own.
    extra_sets = variable(typ.List[str], value=[])

    #: Optimiser steps.
    steps = variable(int, value=1)
    #: The deck in src/.
    deck = ''

    def sets(self):
        return [f'run.steps={self.steps}', f'run.threads={self.threads}', 'run.out_dir="out"']

    def reference_key(self):
        return os.path.splitext(self.deck)[0]

    @run_before('run')
    def set_options(self):
        self.executable_opts = ['train', self.deck]
        for s in self.sets() + self.extra_sets:
            self.executable_opts += ['--set', f"'{s}'"]
        self.job.launcher.options += self.current_partition.extras.get('launcher_options', [])

    @run_before('performance')
    def set_reference(self):
        ref = self.current_partition.extras.get('ndtrain_reference', {}).get(self.reference_key())
        if ref:
            self.reference = {self.current_partition.fullname: {k: tuple(v) for k, v in ref.items()}}

    @property
    def run_json(self):
        return os.path.join(self.stagedir, 'out', 'run.json')

    def loss_bounds(self):
        '''(lowest, highest) final loss that passes.'''
        return (0.0, float('inf'))

    @sanity_function
    def validate(self):
        if not os.path.exists(self.run_json):
            raise SanityError(f'no {self.run_json}: ndtrain did not start training (see the stderr in the stage folder)')
        with open(self.run_json) as f:
            rec = json.load(f)
        res = rec.get('results') or {}
        ranks = sorted(r for rs in rec['job']['hosts'].values() for r in rs)
        loss = res.get('final_loss')
        low, high = self.loss_bounds()
        return sn.all([
            sn.assert_eq(self.job.exitcode, 0, msg='ndtrain exited with {0}'),
            sn.assert_eq(rec['status'], 'finished', msg='run.json status: {0}'),
            sn.assert_eq(res.get('steps_run'), self.steps, msg='steps run: {0}, expected {1}'),
            sn.assert_eq(rec['job']['world_size'], self.num_tasks, msg='world size {0}, expected {1}'),
            sn.assert_eq(ranks, list(range(self.num_tasks)), msg='hosts cover ranks {0}, expected {1}'),
            sn.assert_true(loss is not None, msg='no final loss'),
            sn.assert_bounded(loss if loss is not None else float('nan'), low, high, msg='final loss {0} outside [{1}, {2}]'),
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


@rfm.simple_test
class NdtrainTinyCheck(NdtrainBase):
    descr = 'ndtrain trains the tiny deck: it finishes, learns, and keeps its speed'
    tags = {'ndtrain', 'tiny', 'ci'}
    deck = 'tiny.toml'
    num_tasks = 2
    num_cpus_per_task = 1

    #: Optimiser steps: the deck's own.
    steps = 150
    #: The final loss must be below this. The tiny deck's synthetic data has an entropy floor of
    #: 1.2425 nats/token; 150 steps end at 1.334 on every layout (the layouts agree to 1e-6).
    max_final_loss = variable(float, value=1.5)
    #: No loss can be far below the data's entropy floor: a lower one means a broken loss.
    min_final_loss = variable(float, value=1.0)

    def loss_bounds(self):
        return (self.min_final_loss, self.max_final_loss)

    @sanity_function
    def validate_learning(self):
        return sn.all([self.validate(), sn.assert_found(r'final loss \S+ vs entropy floor', self.stdout)])


@rfm.simple_test
class NdtrainScalingCheck(NdtrainBase):
    '''Strong scaling of bench_small (FSDP over every rank, the deck's global batch of 4
    sequences at every point, micro batch 1): one test case per rank count, each with its own
    reference.'''

    descr = 'ndtrain bench_small strong scaling over 1, 2 and 4 ranks'
    tags = {'ndtrain', 'scaling'}
    deck = 'bench_small.toml'
    #: Ranks (num_tasks) of each test case.
    ranks = parameter([1, 2, 4])
    num_cpus_per_task = 1
    #: Optimiser steps per point (the deck's own 20 would take minutes on a small machine).
    steps = 3

    def sets(self):
        # Micro batch 1: the deck's global batch of 4 sequences splits over 1, 2 and 4 ranks.
        return super().sets() + ['optim.warmup_steps=1', 'train.micro_batch=1']

    @run_after('init')
    def set_ranks(self):
        self.num_tasks = self.ranks

    def reference_key(self):
        return f'bench_small@{self.ranks}'


@rfm.simple_test
class NdtrainGpuCheck(NdtrainBase):
    '''gpu_1b on one GPU node: one rank per GPU, `[run] device = "cuda"` (the deck's).'''

    descr = 'ndtrain trains gpu_1b on the GPUs of one node'
    valid_systems = ['+mpi +gpu']
    tags = {'ndtrain', 'gpu'}
    deck = 'gpu_1b.toml'
    #: GPUs (and ranks) per node.
    gpus_per_node = variable(int, value=4)
    #: Optimiser steps: the deck's own; host threads: the CPUs of each rank's binding.
    steps = 12
    threads = 0

    @run_after('init')
    def set_gpus(self):
        self.num_tasks = self.gpus_per_node
        self.num_tasks_per_node = self.gpus_per_node
        self.num_gpus_per_node = self.gpus_per_node
