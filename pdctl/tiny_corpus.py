"""Small inline English corpus used to train the tiny byte-level BPE tokenizer.

The text is original, plain prose written for this project. Its only job is to give the BPE trainer
enough varied English (plus a few digits and punctuation marks) to learn on the order of a thousand
merges, so that the generated test tokenizer splits ordinary prompts into word-like pieces.
"""

from __future__ import annotations

__all__ = ["CORPUS"]

CORPUS: tuple[str, ...] = (
    """Serving a large language model is mostly a question of moving numbers to the right place at the
right time. A request arrives with a prompt, the prompt is split into tokens, and the model reads all of
those tokens at once in a phase called prefill. Prefill is heavy on arithmetic: every token of the
prompt passes through every layer, and the attention of each token looks back at all the tokens before
it. When prefill is done, the model has produced a cache of keys and values, one entry per token and
per layer, and it has chosen the first new token of the answer.""",
    """The second phase is decode. During decode the model produces one token at a time. Each step reads
the whole cache, adds a single new entry, and picks the next token. Decode does very little arithmetic
per byte of memory it touches, so it is limited by memory bandwidth rather than by compute. Because the
two phases have such different needs, it can pay to run them on different machines. One group of
workers handles prefill for many prompts, and another group keeps long running decode batches busy.""",
    """Splitting the work this way is called disaggregated serving. The hard part is the hand off. After
a prefill worker finishes a prompt, the cache it built must travel to a decode worker before the first
decode step can start. For a model with multi head latent attention the cache is small, because each
token stores one compressed latent vector and a short rotary key instead of full keys and values for
every head. A smaller cache means less data on the wire, shorter transfers, and more requests that fit
in the memory of a single decode node.""",
    """A scheduler sits in front of the cluster. It accepts requests from clients, chooses a prefill
worker with spare capacity, and later chooses a decode worker with enough free cache blocks. It tracks
the time to the first token, the time between tokens, and the number of requests waiting in each queue.
When one pool grows too slow the operator can add workers to it, or move a machine from one role to the
other. Good metrics make these choices easy; poor metrics turn them into guesses.""",
    """Mixture of experts layers add another twist. Instead of one large feed forward block, the layer
holds many small experts and a router that sends each token to only a few of them. A shared expert
sees every token, while the routed experts specialise. The router scores all experts, keeps the top
ones, and mixes their outputs with weights that come from the scores. Load balance matters: if most
tokens pick the same expert, that expert becomes a bottleneck while the others sit idle.""",
    """Testing such a system is easier with a tiny model. A model with three layers and a few hundred
hidden units runs in a blink on an ordinary laptop, yet it exercises the same code paths as a model
with sixty layers. Random weights are fine, as long as they are fixed by a seed and the outputs are not
too flat. If two implementations of the same model agree on every generated token for a dozen prompts,
we gain real confidence that the kernels, the cache layout, and the transfer code are all correct.""",
    """On quiet evenings I like to cook a simple soup. I start by warming olive oil in a heavy pot, then
add a chopped onion, two carrots, and a stick of celery. After ten minutes the kitchen smells sweet and
the vegetables are soft. A spoon of tomato paste, a pinch of salt, some black pepper, and a bay leaf go
in next, followed by a can of beans and about a litre of water or stock. The soup simmers for half an
hour while I slice bread and set the table. A handful of fresh parsley finishes it.""",
    """Baking bread asks for more patience than skill. Mix flour, water, salt, and a little yeast until no
dry flour remains, cover the bowl, and wait. Over several hours the dough rises and grows bubbly. Fold
it a few times, shape it into a round loaf, and let it rest again. Bake it in a very hot oven, first with
a lid to trap steam and then without, until the crust is deep brown and the loaf sounds hollow when you
tap the bottom. Let it cool before cutting, even though the smell makes waiting hard.""",
    """The river behind the old mill runs fast in spring and slow in late summer. Children throw sticks
from the bridge and race to the other side to see whose stick wins. In autumn the trees along the bank
turn yellow and red, and the path is covered with leaves that crunch under every step. In winter the
water freezes at the edges, and the only sounds are the wind, a few crows, and the distant bell of the
church on the hill. People who walk there every day say the place is never the same twice.""",
    """Numbers show up everywhere in a cluster. A node might have 8 accelerators, 2 network cards, 64 cores
and 512 gigabytes of memory. A request might carry 1024 prompt tokens and ask for 256 new ones. A good
decode step takes about 20 milliseconds, and a batch might hold 128 requests at once. Latency targets
are often written as percentiles: the 50th, the 90th, and the 99th. A system that meets its median
target but misses the 99th percentile will still feel slow to the unlucky users in the tail.""",
    """Writing clear code is a kind of kindness to the next reader. Short functions with honest names,
types that say what a value holds, and tests that fail with a useful message all save hours later.
Comments should explain why a choice was made, not repeat what the code already says. When something
breaks in production, the first question is always the same: what changed? A small, reviewed change with
a test is far easier to trust, to roll back, and to explain than a large rewrite done in a hurry.""",
    """Questions people often ask the assistant: How do I restart a worker? What does this error mean?
Why is the first token slow today? Can you summarise the logs from last night? The assistant answers
in plain words, shows the exact command when one is needed, and says so when it does not know. Thank
you for the help! You are welcome, and good luck with the deployment. Hello, how are you? I am fine,
thanks. What is the capital of France? Paris is the capital of France. Please write a short poem about
the sea, the sky, and a small boat that sails home at night.""",
    """A garden teaches timing. Peas and lettuce want cool weather, so they go in early, while tomatoes,
beans, and squash wait until the soil is warm and the nights are mild. Water deeply and not too often,
so the roots grow down instead of staying near the surface. Pull weeds when they are small and the
ground is damp. By midsummer the beds are crowded, the bees are busy in the flowers, and there is more
zucchini than anyone can eat. Neighbours learn to lock their cars, or they find a bag of it inside.""",
    """Memory on an accelerator is divided into blocks. Each block holds the cache entries for a fixed
number of tokens, and a table maps every request to the blocks it owns. When a request finishes, its
blocks return to a free list. When memory runs short, the engine can pause a request, copy its blocks
to host memory, and bring them back later, or it can simply drop the cache and recompute it. Paging
like this lets many requests of different lengths share one pool without wasting space on padding.""",
    """The network between nodes decides how fast a cache can move. Inside one host, devices talk over a
fast local link. Between hosts, traffic crosses network cards and switches, and every copy through host
memory adds delay. Transfer engines try to write directly from the memory of one device into the memory
of another, overlap the copy with useful compute, and send many small blocks as a few large messages.
A careful design measures the bandwidth it actually gets instead of trusting the number on the box.""",
    """Last year we took a train along the coast. The carriage was old but clean, with wide windows and
seats that faced each other across small tables. We passed fishing villages, long empty beaches, and
cliffs where sea birds nested in the cracks of the rock. At one station an old man sold apples and hot
tea from a cart, and half the passengers got off to buy some. The trip took most of the day, and nobody
minded. We read, we slept, we watched the light change on the water, and we talked about nothing much.""",
    """Early computers filled whole rooms and were programmed by setting switches or feeding in cards
punched with holes. Each machine ran one job at a time, and people waited in line for their turn. Later
came terminals, time sharing, and operating systems that let many users work at once. Then personal
computers put a machine on every desk, networks joined them together, and the web joined the networks.
Each step made computing cheaper and closer to the people who used it, and each step surprised someone.""",
    """To restart a worker, first drain it so that the scheduler stops sending new requests. Wait until
its running requests complete, or until a timeout passes. Then stop the process, check the logs for the
reason it was restarted, and start it again with the same configuration. Confirm that it registers with
the scheduler, passes its health check, and serves a small test prompt. Only then return it to the pool.
If the same worker fails again within the hour, take it out of service and open a ticket.""",
    """Attention lets each position of a sequence gather information from the positions before it. A
query from the current token is compared with a key from every earlier token; the scores become weights
through a softmax, and the weights mix the values. Rotary position embeddings rotate parts of the queries
and keys by an angle that depends on the position, so the score between two tokens depends on how far
apart they are. Scaling tricks stretch these angles so that a model trained on short texts can read longer
ones without getting lost.""",
    """My grandmother kept a notebook of recipes written in pencil, with notes in the margins about what
went wrong and what to try next time. Her apple cake used brown sugar, cinnamon, and a lot of butter, and
she always baked it on Sunday morning. Her bean stew needed a whole afternoon on the stove. She measured
nothing, tasted everything, and wrote the amounts down only after someone begged her for them. Cooking
from that notebook today feels like having a conversation with her across the kitchen table.""",
    """Good monitoring starts with a few clear signals. Count the requests that succeed and the ones that
fail. Measure how long each phase takes, and keep the full distribution, not just the average. Watch the
length of every queue and the fraction of cache memory in use. Set alerts on symptoms that users feel,
such as slow first tokens or errors, rather than on every internal number. When an alert fires at three
in the morning, the person on call should know within a minute what is wrong and where to look first.""",
    """The weather changed quickly that afternoon. A warm wind came up from the south, dark clouds piled
over the hills, and the first heavy drops of rain hit the dusty road. Within minutes the street was a
shallow river. Thunder rolled across the valley, and the lights in the shop flickered twice. Then, as
fast as it had come, the storm moved on. The sun came out, the pavement steamed, and a bright rainbow
stood over the fields while the birds started singing again as if nothing had happened.""",
)
